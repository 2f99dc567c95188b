// The strongest edges of each weight-pair type: edges whose PK rank among all computed pairs of
// their type is at most `limit` (rank 1 = strongest), ordered by type and rank.
// param run: string -- run id (default: the latest complete run)
// param limit: int = 20 -- largest within-type rank to show
// param types: types = [] -- weight-pair types, e.g. OK,OV (empty: all)
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (a:Head)-[r]->(b:Head)
WHERE a.run_id = run.id AND r.rank <= $limit AND (size($types) = 0 OR r.kind IN $types)
RETURN r.kind AS kind, r.rank AS rank, a.name AS source, b.name AS target, r.pk AS pk, r.pk_norm AS pk_norm,
       r.z_iso AS z_iso, r.log10_p_iso AS log10_p_iso, r.q_model AS q_model, r.cs AS cs
ORDER BY kind, rank
