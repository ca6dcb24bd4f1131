"""Data helpers (synthetic packed rows for tests and the quickstart; real datasets come with the training script)."""
