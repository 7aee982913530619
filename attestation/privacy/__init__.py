"""Differential privacy: epsilon recomputed without torch and the manifest's ``privacy`` step."""
