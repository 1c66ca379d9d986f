"""The one table of what the seam relies on in the SDK: every function it replaces, calls,
reproduces or reads the state of, and every constructor that creates an attribute it reads.

Name (where it is defined, dotted) -> the first 16 hex digits of the sha256 of its source
in azure-servicebus `switch.SDK_VERSION`. tests/gateway/test_sdk_seam.py hashes each (the
functions `pyamqp_sharing.install` replaces as they were before: `pyamqp_sharing.ORIGINALS`)
and fails on any difference: re-read the function, re-check the module named above its
group, update the hash. Nothing here runs in production; it is data for that test, kept
beside the code that relies on it.
"""

from __future__ import annotations

from typing import Final

_SB = "azure.servicebus."
_AIO = "azure.servicebus._pyamqp.aio."
_TR = "azure.servicebus._transport._pyamqp_transport.PyamqpTransport."

RELIED_ON: Final[dict[str, str]] = {
    # encoding.py: the batch it fills, the mapping and the encoder it reproduces
    f"{_SB}_common.message.ServiceBusMessageBatch.__init__": "c2e5785e5508c0b9",
    f"{_SB}_common.message.ServiceBusMessageBatch.__len__": "ca1b6e70d51c82bf",
    f"{_SB}_common.message.ServiceBusMessageBatch._add": "c87540f24ff7aff6",
    f"{_SB}_common.message.ServiceBusMessageBatch.add_message": "beeab9375ad096e2",
    f"{_SB}_common.message.ServiceBusMessageBatch.max_size_in_bytes": "8b3cfa639d00ab7b",
    f"{_SB}_common.message.ServiceBusMessageBatch.size_in_bytes": "c3295f67fe35a32a",
    f"{_SB}_common.tracing.trace_message": "2f6e845b0de79f95",
    f"{_SB}_common.utils._convert_to_single_service_bus_message": "e2676381005fbc39",
    f"{_SB}_pyamqp._encode.describe_performative": "04873d06202bbd98",
    f"{_SB}_pyamqp._encode.encode_binary": "592ffc7ce70447c3",
    f"{_SB}_pyamqp._encode.encode_list": "d938ddfa788132da",
    f"{_SB}_pyamqp._encode.encode_message_id": "6303a37896e4f875",
    f"{_SB}_pyamqp._encode.encode_null": "da278186214ffab9",
    f"{_SB}_pyamqp._encode.encode_payload": "ee23472f3b06e692",
    f"{_SB}_pyamqp._encode.encode_string": "af92eaf9b188a5d8",
    f"{_SB}_pyamqp._encode.encode_symbol": "602c2949237bfd26",
    f"{_SB}_pyamqp._encode.encode_timestamp": "d4db4c3e2b3d7a0a",
    f"{_SB}_pyamqp._encode.encode_uint": "43ae4a6a3f8cebd4",
    f"{_SB}_pyamqp._encode.encode_ulong": "44e0f71b9a312fb6",
    f"{_SB}_pyamqp._encode.encode_unknown": "eb422212804b71f8",
    f"{_SB}_pyamqp._encode.encode_value": "ad6e6adfa9240c25",
    f"{_SB}_pyamqp.utils.add_batch": "6611b324dde87b2a",
    f"{_SB}_pyamqp.utils.get_message_encoded_size": "d77a0063490ef223",
    f"{_SB}_pyamqp.utils.set_message_annotations": "cc47b339d9bc818c",
    f"{_SB}_pyamqp.utils.set_message_properties": "1d10f88325d466f7",
    f"{_TR}add_batch": "500982e053ca2ce9",
    f"{_TR}build_batch_message": "e77d5b6af22e251d",
    f"{_TR}get_batch_message_encoded_size": "9c3bbdb61f5a38f7",
    f"{_TR}get_message_encoded_size": "31e1ab36a6837c57",
    f"{_TR}set_batch_envelope_properties": "00dd74e73e43691a",
    f"{_TR}to_outgoing_amqp_message": "d59a0ddb48f4bc5f",
    f"{_SB}aio._servicebus_sender_async.ServiceBusSender.create_message_batch": "16a49d11c2809643",
    f"{_SB}aio._servicebus_sender_async.ServiceBusSender.send_messages": "a0d194baf42836b1",
    (
        f"{_SB}aio._transport._pyamqp_transport_async.PyamqpTransportAsync.send_messages_async"
    ): "7c488c86efabaeda",
    # pyamqp_sharing.py replaces (their originals) or depends on; pool.py and shared_cbs.py
    # drive the sender's handler, the connection, its transport and the CBS link pair
    f"{_SB}_pyamqp._encode.encode_frame": "a943d5000389c6a1",
    f"{_AIO}_cbs_async.CBSAuthenticator.__init__": "35652ec43ff6bcbc",
    f"{_AIO}_cbs_async.CBSAuthenticator._cbs_link_ready": "10e83a15cbb86497",
    f"{_AIO}_cbs_async.CBSAuthenticator._on_execute_operation_complete": "2d04a57ba98da5fd",
    f"{_AIO}_cbs_async.CBSAuthenticator._put_token": "d4ad58c3d563498c",
    f"{_AIO}_cbs_async.CBSAuthenticator._update_status": "23c32a8a2c9654e1",
    f"{_AIO}_cbs_async.CBSAuthenticator.close": "ae3c7cbbaaba25c2",
    f"{_AIO}_cbs_async.CBSAuthenticator.handle_token": "f1872de4986d6d1f",
    f"{_AIO}_cbs_async.CBSAuthenticator.open": "1aeb62633d544dfb",
    f"{_AIO}_cbs_async.CBSAuthenticator.update_token": "4d70b3272c006097",
    # shared_cbs.Grant: whether a token put is current, as `_update_status` decides it
    f"{_SB}_pyamqp.cbs.check_expiration_and_refresh_status": "ca18679c5b4c96fe",
    # pool.bind: the sender's audience (`_auth_uri`), as the SDK's handler puts it
    f"{_SB}_servicebus_sender.SenderMixin._create_attribute": "ec7d7bd857f5042e",
    f"{_AIO}_client_async.AMQPClientAsync._keep_alive_async": "7257c34b2981cd2b",
    f"{_AIO}_client_async.AMQPClientAsync.auth_complete_async": "9829ffa7655017aa",
    f"{_AIO}_client_async.AMQPClientAsync.client_ready_async": "1b1589bf969b7fa9",
    f"{_AIO}_client_async.AMQPClientAsync.close_async": "f0d0f8d8ce5abfaf",
    f"{_AIO}_client_async.AMQPClientAsync.open_async": "dd1a3d4ff9645693",
    f"{_AIO}_client_async.SendClientAsync._client_ready_async": "f1ead58047b369af",
    f"{_AIO}_connection_async.Connection._process_incoming_frame": "fe16ec45aba163b2",
    f"{_AIO}_connection_async.Connection._send_frame": "f9d2b8004c77197d",
    f"{_AIO}_connection_async.Connection._read_frame": "3f769504f8d7fec4",
    f"{_AIO}_connection_async.Connection.create_session": "aaac04040fe61c3c",
    f"{_AIO}_connection_async.Connection.listen": "7044b5a2b2337d3d",
    f"{_AIO}_connection_async.Connection.open": "ce876fe27199e181",
    f"{_AIO}_link_async.Link._on_session_state_change": "557e0d7d65db7371",
    f"{_AIO}_link_async.Link._outgoing_attach": "ca406b303c5755d5",
    f"{_AIO}_link_async.Link._set_state": "48a729cd4c6ac9af",
    f"{_AIO}_link_async.Link.attach": "d0da5bcec37bfe08",
    f"{_AIO}_link_async.Link.detach": "5635d70a98fe43b6",
    f"{_AIO}_management_link_async.ManagementLink.__init__": "a279309491ba8b8f",
    f"{_AIO}_management_link_async.ManagementLink._on_message_received": "8a8835464b1a4c6e",
    f"{_AIO}_management_link_async.ManagementLink._on_send_complete": "cf7c67167313a9a4",
    f"{_AIO}_management_link_async.ManagementLink.cancel_operation": "d75cb0c19b13fb25",
    f"{_AIO}_management_link_async.ManagementLink.execute_operation": "7722624197b67c86",
    f"{_AIO}_management_link_async.ManagementLink.open": "35e93a3a70447581",
    f"{_AIO}_sender_async.SenderLink._incoming_attach": "a280c21a87877c2f",
    f"{_AIO}_sender_async.SenderLink._outgoing_transfer": "5cb1b9a74a54535e",
    f"{_AIO}_sender_async.SenderLink.update_pending_deliveries": "a560b7f95dc3e302",
    f"{_AIO}_session_async.Session._outgoing_attach": "0afde8afd340ab6f",
    f"{_AIO}_session_async.Session._outgoing_transfer": "6e829b3d9233b8d0",
    f"{_AIO}_session_async.Session.begin": "695f6df6d84d8f6f",
    f"{_AIO}_session_async.Session.end": "45a549bfd3c378e1",
    f"{_AIO}_transport_async.AsyncTransport._write": "7efff3e8d7d05df2",
    f"{_AIO}_transport_async.AsyncTransport.close": "9303ede138f82a99",
    f"{_AIO}_transport_async.AsyncTransportMixin.read": "cce3f7da868bc405",
    f"{_AIO}_transport_async.AsyncTransportMixin.receive_frame": "4ed0732687e53030",
    f"{_AIO}_transport_async.AsyncTransportMixin.send_frame": "4ed681a31dd74988",
    f"{_AIO}_transport_async.AsyncTransportMixin.write": "59781c195270c175",
    f"{_SB}aio._servicebus_sender_async.ServiceBusSender._create_handler": "9335ab1d2e2c4b80",
    f"{_SB}aio._servicebus_sender_async.ServiceBusSender._open": "75ea88dee0119aba",
    # lean.py: the SDK's send path it stands in for
    f"{_AIO}_client_async.SendClientAsync._client_run_async": "6fcf07f29bf3987b",
    f"{_AIO}_client_async.SendClientAsync._on_send_complete_async": "1726a8c7d4d42ff0",
    f"{_AIO}_client_async.SendClientAsync._send_message_impl_async": "e6264852a88bd98e",
    f"{_AIO}_client_async.SendClientAsync._transfer_message_async": "f51e428bb3b8627a",
    f"{_AIO}_client_async.SendClientAsync.send_message_async": "56d18724a901b037",
    f"{_SB}aio._base_handler_async.BaseHandler._do_retryable_operation": "acd25580239434f3",
    f"{_SB}aio._base_handler_async.BaseHandler._handle_exception": "3271fb7e2757ece3",
    f"{_SB}aio._servicebus_sender_async.ServiceBusSender._send": "8bf5321ffafa575b",
    # pool.py and lean.py call these directly
    f"{_SB}_common.utils.create_properties": "790782ed5860fe71",
    f"{_SB}_common.utils.get_remaining_timeout": "3a05d4ae643495a2",
    f"{_SB}_pyamqp._decode.decode_empty_frame": "b71f92cf18652641",
    f"{_SB}_pyamqp._decode.decode_frame": "5de2d6c8e4595f32",
    f"{_SB}_pyamqp.message._MessageDelivery": "6ea7f5318f1b9ea9",
    f"{_SB}aio._async_utils.create_authentication": "0818e99e0ec00eb2",
    f"{_SB}aio._servicebus_client_async.ServiceBusClient.get_queue_sender": "3834aa929ecb1886",
    f"{_SB}aio._servicebus_client_async.ServiceBusClient.get_topic_sender": "aba65c7ed66769f3",
    # the constructors that create the attributes the seam reads or sets (`_handler`,
    # `_connection`, `_running`, `_transport`, `_amqp_transport`, sessions' and links' state)
    f"{_AIO}_client_async.AMQPClientAsync.__init__": "07a32f02119e1574",
    f"{_AIO}_client_async.SendClientAsync.__init__": "7758c1905d5fdacb",
    f"{_AIO}_connection_async.Connection.__init__": "c881745703f9f023",
    f"{_AIO}_link_async.Link.__init__": "7ea914b093eac605",
    f"{_AIO}_sender_async.SenderLink.__init__": "f389bf3c501f17fd",
    f"{_AIO}_session_async.Session.__init__": "0f584b2c9901adf6",
    f"{_AIO}_transport_async.AsyncTransport.__init__": "72ac0a589a84d4d7",
    f"{_AIO}_transport_async.AsyncTransport.connect": "5c02732164e68cfc",
    f"{_SB}aio._base_handler_async.BaseHandler.__init__": "158f5c155bd81c2f",
    f"{_SB}aio._servicebus_client_async.ServiceBusClient.__init__": "a1d317768fbd4d0f",
    f"{_SB}aio._servicebus_sender_async.ServiceBusSender.__init__": "69cdff20ba740ecc",
}
