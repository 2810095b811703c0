"""Helpers the tests share, some a script uses too (imported as `helpers.<module>` from tests: pytest puts tests/ on
the path; scripts import `tests.helpers.<module>` from the repository root). Oracles that only tests need live here,
not in the library: `greedy` (the exported engine's plain greedy loop), `speculative_greedy` and `dspark_greedy` (the eager
speculation loops, MTP's and DSpark's)."""
