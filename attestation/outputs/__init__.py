"""What a run exports beside its manifest, as the exporter writes it and the verifier reads it: age-encrypted
(confidential) weight files and the training API's op chain."""
