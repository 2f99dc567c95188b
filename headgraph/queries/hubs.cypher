// Heads ranked by total degree (in + out) in the selected graph, with a per-type breakdown:
// one row per (hub, weight-pair type), hubs ordered by degree, then layer and head index.
// param run: string -- run id (default: the latest complete run)
// param limit: int = 10 -- number of hubs
// param types: types = [] -- weight-pair types to count, e.g. OK,OV (empty: all)
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (h:Head) WHERE h.run_id = run.id
OPTIONAL MATCH (h)-[o]->(:Head) WHERE size($types) = 0 OR o.kind IN $types
WITH h, count(o) AS out_degree
OPTIONAL MATCH (h)<-[i]-(:Head) WHERE size($types) = 0 OR i.kind IN $types
WITH h, out_degree, count(i) AS in_degree
WITH h, in_degree, out_degree, in_degree + out_degree AS degree WHERE in_degree + out_degree > 0
WITH h, in_degree, out_degree, degree ORDER BY degree DESC, h.layer, h.head LIMIT $limit
MATCH (h)-[r]-(:Head) WHERE size($types) = 0 OR r.kind IN $types
WITH h, degree, in_degree, out_degree, r.kind AS kind,
     count(CASE WHEN r.target = h.name THEN 1 END) AS kind_in,
     count(CASE WHEN r.source = h.name THEN 1 END) AS kind_out
RETURN h.name AS head, h.layer AS layer, degree, in_degree, out_degree, kind, kind_in, kind_out
ORDER BY degree DESC, layer, h.head, kind
