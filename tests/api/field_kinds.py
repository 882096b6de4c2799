"""Every request field's kind, for test_fields.py's accounting: implemented (`BEHAVIOUR`: the tests
that show what it does), accepted with no effect by definition (`NO_EFFECT`), or refused unless at
its default (`REFUSED_VALUES`: a value that is refused)."""

from __future__ import annotations

from pegaserve.api.protocol import ChatCompletionRequest, CompletionRequest

CONTRACT = "test_contract_colocated::test_contract_case"
STRUCTURED = "test_structured_outputs::test_response_format_json_schema_and_json_object"
AGREE = "test_structured_outputs::test_structured_outputs_and_the_guided_fields_agree"
BEAMS = "test_beam_search::test_completions_beams_are_transformers_beam_search"
LEGACY = "test_tools::test_legacy_functions_come_back_as_one_function_call_streamed_and_not"
TOOLS = "test_tools::test_auto_tool_calls_come_back_as_tool_calls_streamed_and_not"
RESPONSE = "responses.test_responses::test_a_response_is_the_chat_completion_of_its_messages"
TEXT_FORMAT = "responses.test_responses::test_a_json_schema_text_format_holds_the_output"
BAD_RESPONSES = "responses.test_responses::test_bad_responses_bodies_are_a_400_naming_the_parameter"
# field -> the tests that show what it does ("module::test" under tests/api)
BEHAVIOUR = {
    "model": ["test_contract_colocated::test_unknown_model_is_404"],
    "prompt": [
        CONTRACT,
        "test_contract_colocated::test_batch_of_prompts",
        "test_echo_logprobs::test_echo_of_a_string_prompt_is_the_string",
    ],
    "messages": [
        "test_contract_colocated::test_contract_case",
        "test_tokenize::test_messages_tokenize_as_the_chat_endpoint_renders_them",
    ],
    "max_tokens": [CONTRACT, "test_echo_logprobs::test_max_tokens_0_with_echo_scores_the_prompt_only"],
    "max_completion_tokens": [CONTRACT],
    "temperature": [
        "test_sampling_params::test_a_temperature_below_1e_5_is_greedy",
        "test_choices::test_choice_j_samples_with_seed_plus_j_reproducibly_and_distinctly",
    ],
    "top_p": ["test_fields::test_top_p_and_top_k_narrow_sampling"],
    "top_k": ["test_sampling_params::test_top_k_1_is_greedy", "test_fields::test_top_p_and_top_k_narrow_sampling"],
    "min_p": ["test_sampling_params::test_min_p_1_keeps_only_the_best_token"],
    "seed": ["test_choices::test_choice_j_samples_with_seed_plus_j_reproducibly_and_distinctly"],
    "stop": [CONTRACT, "test_choices::test_a_stop_string_ends_only_its_choice"],
    "stop_token_ids": [CONTRACT],
    "ignore_eos": [CONTRACT],
    "min_tokens": [CONTRACT],
    "include_stop_str_in_output": [CONTRACT],
    "skip_special_tokens": [CONTRACT],
    "return_token_ids": [CONTRACT, "test_fields::test_a_chat_response_carries_its_prompt_ids_whatever_n"],
    "return_tokens_as_token_ids": ["test_fields::test_return_tokens_as_token_ids"],
    "stream": [CONTRACT],
    "stream_options": [CONTRACT, "test_fields::test_continuous_usage_stats"],
    "stream_options.include_usage": [CONTRACT],
    "stream_options.continuous_usage_stats": [
        "test_fields::test_continuous_usage_stats",
        "test_fields::test_continuous_usage_stats_count_no_token_in_the_role_chunk",
    ],
    "n": ["test_choices::test_greedy_choices_are_equal", "test_choices::test_a_stop_string_ends_only_its_choice"],
    "best_of": ["test_choices::test_best_of_equal_to_n_returns_every_choice"],
    "presence_penalty": ["test_sampling_params::test_penalties_equal_the_reference"],
    "frequency_penalty": ["test_sampling_params::test_penalties_equal_the_reference"],
    "repetition_penalty": [
        "test_sampling_params::test_penalties_equal_the_reference",
        "test_sampling_params::test_a_tiny_repetition_penalty_stays_finite",
    ],
    "logit_bias": [
        "test_sampling_params::test_a_plus_100_bias_forces_a_token",
        "test_sampling_params::test_a_minus_100_bias_bans_the_greedy_token",
    ],
    "logprobs": [CONTRACT, "test_echo_logprobs::test_echo_with_logprobs_shows_the_prompt_scored_by_the_reference"],
    "top_logprobs": [CONTRACT, "responses.test_responses::test_included_logprobs_are_chats"],
    "logprob_token_ids": ["test_echo_logprobs::test_logprob_token_ids_are_exactly_those_tokens_logprobs"],
    "prompt_logprobs": [
        "test_echo_logprobs::test_prompt_logprobs_in_vllms_shape",
        "test_echo_logprobs::test_chat_prompt_logprobs_are_top_level",
    ],
    "echo": [
        "test_echo_logprobs::test_echo_with_logprobs_shows_the_prompt_scored_by_the_reference",
        "test_echo_logprobs::test_chat_echo_prepends_the_last_message_of_the_reply_role",
    ],
    "truncate_prompt_tokens": ["test_fields::test_truncate_prompt_tokens"],
    "truncation_side": ["test_fields::test_truncate_prompt_tokens"],
    "response_format": ["test_fields::test_a_text_response_format_is_plain_text", STRUCTURED],
    "response_format.type": ["test_fields::test_a_text_response_format_is_plain_text", STRUCTURED],
    "response_format.json_schema": [STRUCTURED],
    "structured_outputs": [AGREE],
    "guided_json": [AGREE],
    "guided_regex": [AGREE],
    "guided_choice": [AGREE],
    "guided_grammar": [AGREE],
    "cache_salt": ["test_fields::test_cache_salt_keeps_cached_prompts_apart"],
    "priority": ["test_fields::test_priority_reaches_the_engine_only_under_the_priority_policy"],
    "prediction": ["test_fields::test_a_predicted_output_changes_no_greedy_token_and_bad_ones_are_a_400"],
    "use_beam_search": [BEAMS, "test_beam_search::test_the_best_beam_can_start_with_a_token_greedy_would_not_pick"],
    "length_penalty": ["test_beam_search::test_eos_ends_a_beam_and_the_length_penalty_weighs_it_against_longer_ones"],
    "allowed_token_ids": ["test_fields::test_allowed_token_ids_are_the_only_tokens_sampled"],
    "bad_words": ["test_fields::test_bad_words_are_never_completed"],
    "request_id": [
        "test_fields::test_the_body_request_id_is_the_correlation_id",
        "test_fields::test_behind_serve_the_body_request_id_beats_the_header_serve_made_up",
    ],
    "add_special_tokens": ["test_fields::test_add_special_tokens_is_the_tokenizers"],
    "add_generation_prompt": ["test_tokenize::test_messages_tokenize_as_the_chat_endpoint_renders_them"],
    "continue_final_message": ["test_echo_logprobs::test_chat_echo_prepends_the_last_message_of_the_reply_role"],
    "chat_template_kwargs": [
        "test_chat_template::test_messages_and_template_kwargs_reach_the_chat_template",
        "test_chat_template::test_template_kwargs_cannot_replace_the_template_or_pass_refused_fields",
    ],
    "tool_choice": ["test_fields::test_tool_choice_without_tools", TOOLS,
                    "test_tools::test_a_named_function_s_arguments_keep_to_its_schema",
                    "test_tools::test_required_tool_calls_keep_to_the_tools_schemas",
                    "test_tools::test_tool_choice_none_shows_no_tools_and_parses_nothing"],
    "tools": [TOOLS],
    "functions": [LEGACY, "test_tools::test_a_forced_legacy_function_call_keeps_to_its_schema"],
    "function_call": [LEGACY, "test_tools::test_a_forced_legacy_function_call_keeps_to_its_schema"],
    "messages.function_call": ["test_tools::test_a_legacy_conversation_reaches_the_template_as_tool_calls_and_answers"],
    "chat_template": ["test_chat_template::test_a_requests_own_chat_template_only_where_the_server_trusts_it"],
    "documents": ["test_chat_template::test_documents_and_reasoning_effort_reach_a_template_that_reads_them"],
    "reasoning_effort": ["test_chat_template::test_documents_and_reasoning_effort_reach_a_template_that_reads_them"],
    "parallel_tool_calls": [TOOLS],
    "modalities": ["test_fields::test_text_is_the_only_modality"],
    "messages.role": [CONTRACT],
    "messages.content": [CONTRACT, "test_tokenize::test_messages_tokenize_as_the_chat_endpoint_renders_them"],
    "messages.name": ["test_chat_template::test_messages_and_template_kwargs_reach_the_chat_template"],
    "messages.tool_calls": ["test_chat_template::test_messages_and_template_kwargs_reach_the_chat_template"],
    "messages.tool_call_id": ["test_chat_template::test_messages_and_template_kwargs_reach_the_chat_template"],
    # the Responses API's own (test_responses.py)
    "input": [RESPONSE, "responses.test_responses::test_input_items_become_chats_messages"],
    "instructions": [RESPONSE],
    "max_output_tokens": [RESPONSE],
    "text": [TEXT_FORMAT], "text.format": [TEXT_FORMAT], "text.verbosity": [BAD_RESPONSES],
    "reasoning": [BAD_RESPONSES, "responses.test_responses::test_input_items_become_chats_messages"],
    "reasoning.effort": [BAD_RESPONSES, "responses.test_responses::test_input_items_become_chats_messages"],
    "reasoning.summary": [BAD_RESPONSES], "reasoning.generate_summary": [BAD_RESPONSES],
    "stream_options.include_obfuscation": [BAD_RESPONSES],
    "truncation": [BAD_RESPONSES,
                   "responses.test_responses::test_truncation_auto_leaves_out_the_conversations_start_until_it_fits"],
    "store": ["responses.test_responses::test_stored_responses_are_read_listed_and_deleted",
              "test_stored_chats::test_a_stored_completion_is_read_back_whole_with_its_messages_streamed_or_not"],
    "metadata": ["test_stored_chats::test_stored_completions_are_listed_filtered_paged_updated_and_deleted",
                 "test_stored_chats::test_bad_stored_completion_requests_are_a_400_naming_the_parameter",
                 "responses.test_background::test_a_background_response_is_queued_then_ends_as_the_foreground_one"],
    "background": ["responses.test_background::test_a_background_response_is_queued_then_ends_as_the_foreground_one",
                   "responses.test_background::test_cancel_stops_the_generation_and_its_engine_request",
                   "responses.test_background::test_a_streamed_background_response_streams_and_replays_from_any_event",
                   "responses.test_background::test_what_cannot_run_in_the_background_or_be_streamed_back_is_a_400_naming_it"],
    "previous_response_id": ["responses.test_responses::test_previous_response_id_continues_its_conversation",
                             "responses.test_responses::test_stored_responses_are_read_listed_and_deleted"],
    "include": ["responses.test_responses::test_included_logprobs_are_chats", BAD_RESPONSES],
}
# accepted, and by definition changing nothing here: (field, a non-default value)
NO_EFFECT = {
    "user": "someone",
    "service_tier": "default",  # one tier
    "spaces_between_special_tokens": False,  # byte-level tokens decode as they are (as vLLM's fast path)
    "safety_identifier": "someone",  # the Responses API's end-user label
    "prompt_cache_key": "k",  # a routing hint: the prefix cache needs none
    "max_tool_calls": 1,  # the Responses API's bound on built-in tools' calls: none run here
}
# refused unless at the default: (field, a non-default value)
REFUSED_VALUES = {
    "kv_transfer_params": {"x": 1}, "vllm_xargs": {"x": 1}, "suffix": "tail",
    "audio": {"voice": "x"}, "web_search_options": {},
    # the Responses API's: no server-side conversations or prompts
    "prompt": {"id": "p"},
    "conversation": "c",
}
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
