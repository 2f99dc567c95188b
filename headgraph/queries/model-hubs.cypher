// Hubs of several models side by side: for the latest complete run of each model, its `limit` heads of highest
// degree in the selected graph (ties by layer, then head), with PageRank and the roles significant for them.
// Degrees count selected edges, so they compare only between runs selected alike (the same --top-k or
// thresholds) on models of similar size; a hub of one model is no evidence about the other.
// param models: list = [] -- model names, e.g. gpt2,induction-2l (empty: every model in the store)
// param limit: int = 5 -- hubs per model
MATCH (run:Run)-[:OF_MODEL]->(m:Model) WHERE run.status = 'complete' AND (size($models) = 0 OR m.name IN $models)
WITH m, max(run.created) AS created
MATCH (run:Run)-[:OF_MODEL]->(m) WHERE run.status = 'complete' AND run.created = created
WITH m, max(run.id) AS run
MATCH (h:Head) WHERE h.run_id = run AND h.degree > 0
OPTIONAL MATCH (o:Head)
WHERE o.run_id = run AND (o.degree > h.degree OR (o.degree = h.degree AND (o.layer < h.layer OR (o.layer = h.layer AND o.head < h.head))))
WITH m, run, h, count(o) + 1 AS hub_rank WHERE hub_rank <= $limit
RETURN m.name AS model, hub_rank, h.name AS head, h.layer AS layer, h.degree AS degree, h.pagerank AS pagerank,
       h.roles AS roles, m.n_layers AS n_layers, m.n_heads AS n_heads, run
ORDER BY model, hub_rank
