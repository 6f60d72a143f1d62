"""What learners and the synchronizer say to each other (DESIGN §4): the messages, the one client,
the credentials and the published versions a learner reads.

:mod:`~diloco_async.protocol.messages` holds the pydantic control messages;
:mod:`~diloco_async.protocol.client` the client of the HTTP API;
:mod:`~diloco_async.protocol.auth` the per-learner credentials (HMAC tokens);
:mod:`~diloco_async.protocol.versions` the published fragment versions, read without copies.
"""
