"""Examples that a test runs."""
