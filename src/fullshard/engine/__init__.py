"""The sharding engine: imports torch only, knows nothing of the front end."""
