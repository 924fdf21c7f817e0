"""The demo: synthetic legal contracts, their input shards, and the demo model setup."""
