// In-class vs out-of-class heads of the selected graph (heads with at least one edge of the given types).
// A head is in-class when its name is in `heads`, or (when `heads` is empty) when one of its known-class
// labels is in `classes` (empty: any label). Head names are listed in layer/head order.
// param run: string -- run id (default: the latest complete run)
// param classes: list = [] -- class labels counted as in-class, e.g. induction,previous-token (empty: any)
// param heads: list = [] -- explicit in-class head names instead of labels, e.g. L5H1,L5H5
// param types: types = [] -- weight-pair types forming the graph, e.g. OQ,OK,OV (empty: all)
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (h:Head)-[r]-(:Head) WHERE h.run_id = run.id AND (size($types) = 0 OR r.kind IN $types)
WITH DISTINCT h
UNWIND CASE WHEN h.classes IS NULL OR size(h.classes) = 0 THEN [''] ELSE h.classes END AS label
WITH h, count(CASE WHEN label <> '' AND (size($classes) = 0 OR label IN $classes) THEN 1 END) AS label_hits
WITH h, CASE WHEN size($heads) > 0 THEN h.name IN $heads ELSE label_hits > 0 END AS in_class
WITH h, CASE WHEN in_class THEN 'in-class' ELSE 'out-of-class' END AS membership
ORDER BY h.layer, h.head SKIP 0
RETURN membership, count(h) AS n_heads, collect(h.name) AS names
ORDER BY membership
