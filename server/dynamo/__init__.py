"""The server role as an NVIDIA Dynamo backend worker (`iris serve --dynamo`): Dynamo's
preprocessed requests in, Iris's tokens out, the KV events relayed to Dynamo's router."""
