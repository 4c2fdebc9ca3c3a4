"""The ledger: its SQLite store, its rows, and its replicated log."""
