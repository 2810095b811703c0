"""Helpers the tests share that a script uses too (imported as `helpers.<module>` from tests: pytest puts tests/ on
the path; scripts import `tests.helpers.<module>` from the repository root)."""
