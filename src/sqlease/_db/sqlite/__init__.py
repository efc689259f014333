"""SQLite through the standard library's sqlite3."""
