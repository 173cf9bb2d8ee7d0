"""The formats kandevd reads and writes: strict JSON (jsonstrict.py), YAML loaded safely
and within limits (yamlsafe.py), JSON Schema checks with clear messages
(schemacheck.py), and JSON files written atomically under a lock (jsonfile.py)."""
