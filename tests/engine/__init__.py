"""The engine (allocator/engine): driven with messages and a clock, on real SQLite ledgers."""
