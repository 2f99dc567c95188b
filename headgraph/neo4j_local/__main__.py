import sys

from headgraph.neo4j_local.server import main

sys.exit(main())
