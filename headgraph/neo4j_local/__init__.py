"""A local loopback Neo4j 5.26 (no Docker) and the Neo4j Browser assets served beside it."""
