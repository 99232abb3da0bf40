"""qvlctl: query and admin client for qvld (never imports the engine)."""
