"""`shardc plan`: memory/speed arithmetic, candidate search, report."""
