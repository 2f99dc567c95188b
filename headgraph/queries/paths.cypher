// Strongest directed paths (1 to 3 edges, earlier to later layers) from a head or layer to a head or layer.
// A path's strength is its bottleneck (smallest PK along it), ties broken by summed PK, then fewer hops.
// Dialect-neutral form: variable-length match, no shortestPath and no list comprehensions; the route is
// collected hop by hop in layer order (edges carry their endpoint names).
// param run: string -- run id (default: the latest complete run)
// param source: node -- start head (L1H3) or layer (L1: all its heads)
// param target: node -- end head (L5H1) or layer (L5)
// param max_hops: int = 3 -- longest path to consider (at most 3)
// param limit: int = 10 -- number of paths
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH p = (a:Head)-[*1..3]->(b:Head)
WHERE a.run_id = run.id
  AND (a.name = $source OR a.name STARTS WITH ($source + 'H') OR a.name STARTS WITH ($source + 'KV'))
  AND (b.name = $target OR b.name STARTS WITH ($target + 'H') OR b.name STARTS WITH ($target + 'KV'))
  AND length(p) <= $max_hops
UNWIND relationships(p) AS r
WITH p, r ORDER BY r.source_layer SKIP 0
WITH p, collect(r.source + ' -' + r.kind + '-> ' + r.target) AS route, count(r) AS hops,
     min(r.pk) AS bottleneck, sum(r.pk) AS total_pk
RETURN route, hops, bottleneck, total_pk
ORDER BY bottleneck DESC, total_pk DESC, hops
LIMIT $limit
