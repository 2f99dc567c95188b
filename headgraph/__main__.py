from headgraph.cli import main

main()
