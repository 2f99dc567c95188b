// Heads with the networkx centralities stored on them (selected graph), ordered by degree then PageRank.
// param run: string -- run id (default: the latest complete run)
// param limit: int = 20 -- number of heads
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (h:Head) WHERE h.run_id = run.id
RETURN h.name AS head, h.layer AS layer, h.degree AS degree, h.in_degree AS in_degree, h.out_degree AS out_degree,
       h.weighted_degree AS weighted_degree, h.pagerank AS pagerank, h.hits_hub AS hits_hub,
       h.hits_authority AS hits_authority, h.betweenness AS betweenness
ORDER BY degree DESC, pagerank DESC, layer, h.head
LIMIT $limit
