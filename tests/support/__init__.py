"""Code shared by several test modules (import it as `tests.support.<module>`)."""
