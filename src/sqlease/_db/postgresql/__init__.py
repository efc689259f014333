"""PostgreSQL through psycopg 3."""
