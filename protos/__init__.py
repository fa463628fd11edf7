"""The wire protocol (streamdiloco.v1) and its generated code: arrives with the gRPC issue."""
