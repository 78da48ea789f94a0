"""Version 1 of the admin API: ``admin_pb2`` (messages) and ``admin_pb2_grpc`` (the service),
generated from ``protos/extproc/api/admin/v1/admin.proto``; do not edit them by hand."""
