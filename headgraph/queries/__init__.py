"""Named Cypher queries (one .cypher file each) and the runner that executes them on any store."""
