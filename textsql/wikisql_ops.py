"""WikiSQL's aggregation and condition operators, indexed as in the release's `sql` field."""

AGG_OPS = ["", "MAX", "MIN", "COUNT", "SUM", "AVG"]
COND_OPS = ["=", ">", "<", "OP"]
