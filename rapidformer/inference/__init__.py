"""After training: a run's checkpoint restored (restore.py), scored (`rapidformer eval`) or
used on new rows (predictors.py, rows.py: `rapidformer predict`)."""
