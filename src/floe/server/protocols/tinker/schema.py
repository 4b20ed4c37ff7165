"""The Tinker wire schema (`tinker_public.proto`, as shipped in the tinker 0.38.0 SDK) as
protobuf message classes in a private descriptor pool, so floe speaks the protocol without
importing the SDK (and never clashes with it when both live in one process).

The serialized file descriptor below is copied from the SDK's generated `tinker_public_pb2`
(tinker 0.38.0, Apache-2.0, Thinking Machines Lab). Messages used by the server:
`ForwardBackwardRequest` (request body), `ForwardBackwardOutput` and `SampleResponse`
(results), with their parts (`Tensor`, `BatchedTensor`, `ArrayRecord`, `SampledSequence`,
`TopkLogprobs`).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool, message_factory

SDK_VERSION = "0.38.0"

_SERIALIZED = (
    b'\n\x13tinker_public.proto\x12\rtinker_public"\x9c\x03\n\x0eSampleResponse\x121\n\tsequences\x18\x01 \x03(\x0b2\x1e.tinker_public.Sampl'
    b'edSequence\x12\x1c\n\x0fprompt_logprobs\x18\x02 \x01(\x0cH\x00\x88\x01\x01\x12>\n\x14topk_prompt_logprobs\x18\x03 \x01(\x0b2\x1b.tinker_public.TopkLogpr'
    b'obsH\x01\x88\x01\x01\x12\x1f\n\x17prompt_cache_hit_tokens\x18\x04 \x01(\x05\x12:\n\x16target_prompt_logprobs\x18\x05 \x01(\x0b2\x15.tinker_public.Tensor'
    b'H\x02\x88\x01\x01\x12>\n\x11prompt_alt_tokens\x18\x06 \x01(\x0b2\x1e.tinker_public.PromptAltTokensH\x03\x88\x01\x01B\x12\n\x10_prompt_logprobsB\x17\n\x15_to'
    b'pk_prompt_logprobsB\x19\n\x17_target_prompt_logprobsB\x14\n\x12_prompt_alt_tokens"a\n\x0fPromptAltTokens\x12%\n\x06tokens'
    b'\x18\x01 \x01(\x0b2\x15.tinker_public.Tensor\x12\'\n\x08logprobs\x18\x02 \x01(\x0b2\x15.tinker_public.Tensor"\xd0\x01\n\x0fSampledSequence\x12.\n\x0bst'
    b'op_reason\x18\x01 \x01(\x0e2\x19.tinker_public.StopReason\x12\x0e\n\x06tokens\x18\x02 \x01(\x0c\x12\x15\n\x08logprobs\x18\x03 \x01(\x0cH\x00\x88\x01\x01\x12?\n\x15topk_sample'
    b'd_logprobs\x18\x04 \x01(\x0b2\x1b.tinker_public.TopkLogprobsH\x01\x88\x01\x01B\x0b\n\t_logprobsB\x18\n\x16_topk_sampled_logprobs"N\n\x0cTop'
    b'kLogprobs\x12\x11\n\ttoken_ids\x18\x01 \x01(\x0c\x12\x10\n\x08logprobs\x18\x02 \x01(\x0c\x12\t\n\x01k\x18\x03 \x01(\r\x12\x0e\n\x06length\x18\x04 \x01(\r"F\n\tSparseCsr\x12\x0e\n\x06values'
    b'\x18\x01 \x01(\x0c\x12\x14\n\x0ccrow_indices\x18\x02 \x01(\x0c\x12\x13\n\x0bcol_indices\x18\x03 \x01(\x0c"\x89\x01\n\x06Tensor\x12\x0f\n\x05dense\x18\x01 \x01(\x0cH\x00\x12.\n\nsparse_csr\x18\x02 \x01('
    b'\x0b2\x18.tinker_public.SparseCsrH\x00\x12#\n\x05dtype\x18\x03 \x01(\x0e2\x14.tinker_public.DType\x12\r\n\x05shape\x18\x04 \x03(\x03B\n\n\x08encoding"k\n'
    b'\rBatchedTensor\x12\x0c\n\x04data\x18\x01 \x01(\x0c\x12\x0f\n\x07offsets\x18\x02 \x01(\x0c\x12#\n\x05dtype\x18\x03 \x01(\x0e2\x14.tinker_public.DType\x12\x16\n\x0etrailing_s'
    b'hape\x18\x04 \x03(\x03"\xb8\x01\n\x0bArrayRecord\x12\x10\n\x08type_tag\x18\x01 \x01(\t\x126\n\x06fields\x18\x02 \x03(\x0b2&.tinker_public.ArrayRecord.FieldsE'
    b'ntry\x12\x12\n\nnum_datums\x18\x03 \x01(\x03\x1aK\n\x0bFieldsEntry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12+\n\x05value\x18\x02 \x01(\x0b2\x1c.tinker_public.BatchedTenso'
    b'r:\x028\x01"\xdd\x01\n\x15ForwardBackwardOutput\x12\x1b\n\x13loss_fn_output_type\x18\x01 \x01(\t\x123\n\x0floss_fn_outputs\x18\x02 \x03(\x0b2\x1a.tinker_p'
    b'ublic.ArrayRecord\x12B\n\x07metrics\x18\x03 \x03(\x0b21.tinker_public.ForwardBackwardOutput.MetricsEntry\x1a.\n\x0cMetrics'
    b'Entry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12\r\n\x05value\x18\x02 \x01(\x01:\x028\x01"\xb8\x03\n\x16ForwardBackwardRequest\x12\x10\n\x08model_id\x18\x01 \x01(\t\x12\x0e\n\x06seq_id\x18\x02 \x01'
    b'(\x05\x12"\n\x04data\x18\x03 \x03(\x0b2\x14.tinker_public.Datum\x12\x0f\n\x07loss_fn\x18\x04 \x01(\t\x12O\n\x0eloss_fn_config\x18\x05 \x03(\x0b27.tinker_public.'
    b'ForwardBackwardRequest.LossFnConfigEntry\x12\x14\n\x0cforward_only\x18\x06 \x01(\x08\x12T\n\x11loss_fn_config_v2\x18\x07 \x03(\x0b29.tink'
    b'er_public.ForwardBackwardRequest.LossFnConfigV2Entry\x1a3\n\x11LossFnConfigEntry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12\r\n\x05value\x18'
    b'\x02 \x01(\x01:\x028\x01\x1aU\n\x13LossFnConfigV2Entry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12-\n\x05value\x18\x02 \x01(\x0b2\x1e.tinker_public.LossConfigValue:\x028\x01'
    b'"<\n\x0fLossConfigValue\x12\x10\n\x06number\x18\x01 \x01(\x01H\x00\x12\x0e\n\x04text\x18\x02 \x01(\tH\x00B\x07\n\x05value"\xb4\x02\n\x05Datum\x12)\n\x0bmodel_input\x18\x01 \x03(\x0b2\x14.'
    b'tinker_public.Chunk\x12>\n\x0eloss_fn_inputs\x18\x02 \x03(\x0b2&.tinker_public.Datum.LossFnInputsEntry\x128\n\x11model_inp'
    b'ut_spans\x18\x03 \x03(\x0b2\x1d.tinker_public.ProvenanceSpan\x12:\n\x13loss_fn_input_spans\x18\x04 \x03(\x0b2\x1d.tinker_public.Prove'
    b'nanceSpan\x1aJ\n\x11LossFnInputsEntry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12$\n\x05value\x18\x02 \x01(\x0b2\x15.tinker_public.Tensor:\x028\x01"\x96\x01\n\x0eProven'
    b'anceSpan\x12<\n\rprompt_tokens\x18\x01 \x01(\x0b2#.tinker_public.PromptProvenanceSpanH\x00\x12>\n\x0esampled_tokens\x18\x02 \x01(\x0b2$'
    b'.tinker_public.SampledProvenanceSpanH\x00B\x06\n\x04span"K\n\x14PromptProvenanceSpan\x12\x13\n\x0bsequence_id\x18\x01 \x01(\t\x12\x0e\n\x06o'
    b'ffset\x18\x02 \x01(\x03\x12\x0e\n\x06length\x18\x03 \x01(\x03"L\n\x15SampledProvenanceSpan\x12\x13\n\x0bsequence_id\x18\x01 \x01(\t\x12\x0e\n\x06offset\x18\x02 \x01(\x03\x12\x0e\n\x06len'
    b'gth\x18\x03 \x01(\x03"\x9f\x01\n\x05Chunk\x127\n\x0cencoded_text\x18\x01 \x01(\x0b2\x1f.tinker_public.EncodedTextChunkH\x00\x12*\n\x05image\x18\x02 \x01(\x0b2\x19.ti'
    b'nker_public.ImageChunkH\x00\x12(\n\x04dmel\x18\x03 \x01(\x0b2\x18.tinker_public.DmelChunkH\x00B\x07\n\x05chunk""\n\x10EncodedTextChunk\x12'
    b'\x0e\n\x06tokens\x18\x01 \x01(\x0c"\xb6\x01\n\nImageChunk\x12\x0c\n\x04data\x18\x01 \x01(\x0c\x12\x0e\n\x06format\x18\x02 \x01(\t\x12\x1c\n\x0fexpected_tokens\x18\x03 \x01(\x05H\x00\x88\x01\x01\x12@\n\x13ov'
    b'erride_dimensions\x18\x04 \x01(\x0b2\x1e.tinker_public.ImageDimensionsH\x01\x88\x01\x01B\x12\n\x10_expected_tokensB\x16\n\x14_override_di'
    b'mensions"0\n\x0fImageDimensions\x12\r\n\x05width\x18\x01 \x01(\r\x12\x0e\n\x06height\x18\x02 \x01(\r"\x19\n\tDmelChunk\x12\x0c\n\x04dmel\x18\x01 \x01(\x0c"\xa5\x02\n\x0eSampli'
    b'ngParams\x12\x17\n\nmax_tokens\x18\x01 \x01(\x05H\x01\x88\x01\x01\x12\x11\n\x04seed\x18\x02 \x01(\x04H\x02\x88\x01\x01\x12\x18\n\x0btemperature\x18\x03 \x01(\x02H\x03\x88\x01\x01\x12\x12\n\x05top_k\x18\x04 \x01(\x05H\x04\x88'
    b'\x01\x01\x12\x12\n\x05top_p\x18\x05 \x01(\x02H\x05\x88\x01\x01\x12/\n\tstop_strs\x18\x06 \x01(\x0b2\x1a.tinker_public.StopStringsH\x00\x120\n\x0bstop_tokens\x18\x07 \x01(\x0b2\x19.t'
    b'inker_public.StopTokensH\x00B\x06\n\x04stopB\r\n\x0b_max_tokensB\x07\n\x05_seedB\x0e\n\x0c_temperatureB\x08\n\x06_top_kB\x08\n\x06_top_p"\x1d\n'
    b'\x0bStopStrings\x12\x0e\n\x06values\x18\x01 \x03(\t"\x1c\n\nStopTokens\x12\x0e\n\x06values\x18\x01 \x03(\x05*:\n\nStopReason\x12\x14\n\x10STOP_REASON_STOP\x10\x00\x12\x16'
    b'\n\x12STOP_REASON_LENGTH\x10\x01*g\n\x05DType\x12\x15\n\x11DTYPE_UNSPECIFIED\x10\x00\x12\x11\n\rDTYPE_FLOAT32\x10\x01\x12\x0f\n\x0bDTYPE_INT64\x10\x02\x12\x0f\n\x0bDT'
    b'YPE_INT32\x10\x03\x12\x12\n\x0eDTYPE_BFLOAT16\x10\x04b\x06proto3'
)

_POOL = descriptor_pool.DescriptorPool()
_FILE = _POOL.AddSerializedFile(_SERIALIZED)


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequest = _message("ForwardBackwardRequest")
ForwardBackwardOutput = _message("ForwardBackwardOutput")
SampleResponse = _message("SampleResponse")
Tensor = _message("Tensor")

DTYPE_FLOAT32 = _POOL.FindEnumTypeByName("tinker_public.DType").values_by_name["DTYPE_FLOAT32"].number
DTYPE_INT64 = _POOL.FindEnumTypeByName("tinker_public.DType").values_by_name["DTYPE_INT64"].number
STOP_REASON_STOP = _POOL.FindEnumTypeByName("tinker_public.StopReason").values_by_name["STOP_REASON_STOP"].number
STOP_REASON_LENGTH = _POOL.FindEnumTypeByName("tinker_public.StopReason").values_by_name["STOP_REASON_LENGTH"].number
