"""Project tools run from the repository root (`python -m tools.<name>`), outside the hashed engine."""
