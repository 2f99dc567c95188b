"""Reports of runs: figures, report.md/html, comparisons of two runs, the closing summary of analyze."""
