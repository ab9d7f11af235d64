"""Small helpers every floor may use: value checks (checks), optional extras (extras), Markdown tables (tables)."""
