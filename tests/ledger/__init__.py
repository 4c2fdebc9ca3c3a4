"""The ledger (allocator/ledger): SQLite, migrations, backups, the replicated log."""
