"""The object-storage tier (``s3://bucket/prefix?endpoint=...&region=...&size=...``): chunks
as objects in any S3-compatible store (AWS S3, MinIO, Ceph, SeaweedFS, rclone), verified,
bounded by ``size`` and learnt back from the bucket after a restart.

    tier.py     S3Tier: the five primitives, the bound, listing what the bucket holds
    index.py    Held: what this process knows the bucket holds, in deletion order
    client.py   Bucket: batches of requests on awscrt's S3 client, each bounded by a deadline

Credentials are the AWS chain's (environment, ``~/.aws`` files, web identity for a
Kubernetes service account, container and instance metadata): never in the URL.
"""

from lmtier.tiers.s3.tier import S3Tier

__all__ = ["S3Tier"]
