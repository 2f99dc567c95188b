"""Loaders: models in (TransformerBridge), graphs out to a store (LadybugDB or Neo4j)."""
