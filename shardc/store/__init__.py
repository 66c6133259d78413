"""Object storage: local and S3 backends, push/pull of a build."""
