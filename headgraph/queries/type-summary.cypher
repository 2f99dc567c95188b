// Per weight-pair type: number of selected edges, distinct source/target heads, PK statistics, mean isotropic
// z, smallest calibrated q and mean composition score (cs, where defined).
// param run: string -- run id (default: the latest complete run)
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (a:Head)-[r]->(b:Head) WHERE a.run_id = run.id
RETURN r.kind AS kind, count(r) AS edges, count(DISTINCT a) AS sources, count(DISTINCT b) AS targets,
       min(r.pk) AS min_pk, avg(r.pk) AS mean_pk, max(r.pk) AS max_pk, avg(r.z_iso) AS mean_z_iso,
       min(r.q_model) AS min_q_model, avg(r.cs) AS mean_cs
ORDER BY kind
