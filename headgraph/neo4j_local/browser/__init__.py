"""Neo4j Browser extras: the head-graph style (style.grass), the guide with canned queries (guide.html), and the
loopback server that hands both to Browser (`python3 -m headgraph.neo4j_local.browser.assets_server`)."""
