// The edges of one head, incoming and outgoing, per weight-pair type, strongest first.
// param run: string -- run id (default: the latest complete run)
// param head: head -- the head, e.g. L4H7
// param types: types = [] -- weight-pair types, e.g. OK,OV (empty: all)
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (a:Head)-[r]->(b:Head)
WHERE a.run_id = run.id AND (a.name = $head OR b.name = $head) AND (size($types) = 0 OR r.kind IN $types)
RETURN CASE WHEN a.name = $head THEN 'out' ELSE 'in' END AS direction, r.kind AS kind,
       CASE WHEN a.name = $head THEN b.name ELSE a.name END AS neighbor,
       r.pk AS pk, r.rank AS rank, r.z_iso AS z_iso, r.q_model AS q_model
ORDER BY direction, kind, pk DESC, neighbor
