"""The serving designs of MemServe's Table 4, plus colocated instances.

Each design says where cached KV is kept and where it moves; the front end
(cluster/frontend.py) runs a request through it:

  colocated     one instance prefills and decodes; it caches (context caching);
  pd-basic      P prefills, transfers the prompt's KV to D, which decodes; nothing
                is cached on either side (DistServe, Splitwise);
  pd-caching-1  P keeps the prompt's KV cached (system prompts, shared documents);
  pd-caching-2  D keeps it too, and what it generates: P sends only the blocks D
                lacks (transfer_with_insert);
  pd-caching-3  D returns the finished turn's KV to P, whose cache then grows
                turn by turn (multi-turn chat).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Design:
    name: str
    disaggregated: bool
    keep_at_prefill: bool = True
    keep_at_decode: bool = False  # and send D only what it lacks
    return_to_prefill: bool = False


DESIGNS = {d.name: d for d in (
    Design("colocated", disaggregated=False),
    Design("pd-basic", disaggregated=True, keep_at_prefill=False),
    Design("pd-caching-1", disaggregated=True),
    Design("pd-caching-2", disaggregated=True, keep_at_decode=True),
    Design("pd-caching-3", disaggregated=True, keep_at_decode=True, return_to_prefill=True),
)}


def design(name: str) -> Design:
    try:
        return DESIGNS[name]
    except KeyError:
        raise ValueError(f"unknown design {name!r}; choose from {sorted(DESIGNS)}") from None
