// Hubs whose identity role is significant (Head.identity_sig = true, written by the roles analysis),
// ranked by total degree in the selected graph. Empty when roles have not been run for this run.
// param run: string -- run id (default: the latest complete run)
// param limit: int = 10 -- number of heads
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (h:Head) WHERE h.run_id = run.id AND h.identity_sig = true
OPTIONAL MATCH (h)-[o]->(:Head)
WITH h, count(o) AS out_degree
OPTIONAL MATCH (h)<-[i]-(:Head)
WITH h, out_degree, count(i) AS in_degree
RETURN h.name AS head, h.layer AS layer, h.identity_score AS identity_score, in_degree + out_degree AS degree,
       in_degree, out_degree
ORDER BY degree DESC, identity_score DESC, layer, h.head
LIMIT $limit
