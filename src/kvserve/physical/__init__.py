"""Physical KV memory: the byte pool the memory core's page ids index into."""
