"""What `batchspec report` renders: one output's cost, acceptance and saving (output.py), or night
over night across a folder of outputs (trend.py)."""
