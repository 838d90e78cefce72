"""Database models, sessions and repositories shared by api and worker."""
