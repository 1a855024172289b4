"""Operations on nested data and on the process set that ``ops.py`` does not hold (see each module)."""
