"""The serving engine: requests, scheduler, model runner, sampler, offline API."""
