"""dstack's app-compose: compose-hash and app-id, the compose YAML with source positions, and the compose audit."""
