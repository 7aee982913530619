"""Deployment to dstack: the measured app-compose and the machine plan."""
