"""The admin API, by version."""
