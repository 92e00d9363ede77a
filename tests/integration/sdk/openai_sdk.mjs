// The official OpenAI Node SDK against a tidepool gateway (run by test_openai_sdk.py).
//
//   node openai_sdk.mjs <node_modules dir> <base url>
//
// Makes every call below with the SDK and prints one JSON object of what the SDK returned
// (texts, indices, event types, usage); the Python test compares it with the gateway's own
// answers to the same requests over plain HTTP. Any SDK error is printed and exits 1.
import { createRequire } from "node:module";
import path from "node:path";

const [modules, baseURL] = process.argv.slice(2);
const require = createRequire(path.join(modules, "noop.js"));
const OpenAI = require("openai");

const client = new OpenAI({ baseURL, apiKey: "sk-test", maxRetries: 0, timeout: 120000 });
const model = "stories260K";
const messages = [{ role: "user", content: "Tell me a story." }];
const out = {};

async function main() {
  // completions, not streamed and streamed
  let r = await client.completions.create({
    model, prompt: "Once upon a time", max_tokens: 24, temperature: 0,
  });
  out.completion = { text: r.choices[0].text, finish: r.choices[0].finish_reason, usage: r.usage };
  let s = await client.completions.create({
    model, prompt: "Once upon a time", max_tokens: 24, temperature: 0, stream: true,
  });
  out.completion_stream = "";
  for await (const chunk of s) out.completion_stream += chunk.choices[0]?.text ?? "";

  // chat, not streamed and streamed
  r = await client.chat.completions.create({ model, messages, max_tokens: 24, temperature: 0 });
  out.chat = { text: r.choices[0].message.content, usage: r.usage };
  s = await client.chat.completions.create({
    model, messages, max_tokens: 24, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  out.chat_stream = "";
  for await (const chunk of s) {
    out.chat_stream += chunk.choices[0]?.delta?.content ?? "";
    if (chunk.usage) out.chat_stream_usage = chunk.usage;
  }

  // n = 2 with a seed (mtp_depth 0: seeded sampling exact whatever runs beside it)
  r = await client.completions.create({
    model, prompt: "Once upon a time", max_tokens: 24, temperature: 1, seed: 11, n: 2,
    mtp_depth: 0,
  });
  out.n2 = r.choices.map((c) => [c.index, c.text]);
  r = await client.chat.completions.create({
    model, messages, max_tokens: 24, temperature: 1, seed: 11, n: 2, mtp_depth: 0,
  });
  out.chat_n2 = r.choices.map((c) => [c.index, c.message.content]);
  s = await client.chat.completions.create({
    model, messages, max_tokens: 24, temperature: 1, seed: 11, n: 2, mtp_depth: 0, stream: true,
  });
  out.chat_n2_stream = ["", ""];
  for await (const chunk of s)
    for (const c of chunk.choices) out.chat_n2_stream[c.index] += c.delta?.content ?? "";

  // batched prompts: text and token ids
  r = await client.completions.create({
    model, prompt: ["Once upon a time", "Tom and Sue went to the"], max_tokens: 24,
    temperature: 0,
  });
  out.batch = r.choices.map((c) => [c.index, c.text]);
  out.batch_usage = r.usage;
  r = await client.completions.create({
    model, prompt: [[1, 403, 407, 261, 378], [1, 403, 407]], max_tokens: 24, temperature: 0,
  });
  out.batch_ids = r.choices.map((c) => [c.index, c.text]);
  s = await client.completions.create({
    model, prompt: ["Once upon a time", "Tom and Sue went to the"], max_tokens: 24,
    temperature: 0, stream: true,
  });
  out.batch_stream = ["", ""];
  for await (const chunk of s)
    for (const c of chunk.choices) out.batch_stream[c.index] += c.text;

  // log-probabilities: completions (with echo too), chat, streamed and not
  r = await client.completions.create({
    model, prompt: "Once upon a time", max_tokens: 8, temperature: 0, logprobs: 2,
  });
  out.lp = r.choices[0].logprobs;
  r = await client.completions.create({
    model, prompt: "Once upon a time", max_tokens: 8, temperature: 0, logprobs: 2, echo: true,
  });
  out.lp_echo = { text: r.choices[0].text, logprobs: r.choices[0].logprobs };
  s = await client.completions.create({
    model, prompt: "Once upon a time", max_tokens: 8, temperature: 0, logprobs: 2, stream: true,
  });
  out.lp_stream = [];
  for await (const chunk of s)
    for (const c of chunk.choices) if (c.logprobs) out.lp_stream.push(...c.logprobs.token_logprobs);
  r = await client.chat.completions.create({
    model, messages, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3,
  });
  out.chat_lp = r.choices[0].logprobs.content;
  s = await client.chat.completions.create({
    model, messages, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3,
    stream: true,
  });
  out.chat_lp_stream = [];
  for await (const chunk of s)
    for (const c of chunk.choices) if (c.logprobs) out.chat_lp_stream.push(...c.logprobs.content);

  // the Responses API, not streamed and streamed
  const resp = await client.responses.create({
    model, input: "Tell me a story.", max_output_tokens: 24, temperature: 0,
    instructions: "You tell short stories.", store: false,
  });
  out.response = {
    id: resp.id, object: resp.object, status: resp.status, text: resp.output_text,
    usage: resp.usage, store: resp.store, instructions: resp.instructions,
  };
  const rs = await client.responses.create({
    model, input: [{ role: "user", content: [{ type: "input_text", text: "Tell me a story." }] }],
    max_output_tokens: 24, temperature: 0, stream: true,
    instructions: "You tell short stories.",
  });
  out.response_stream = { types: [], seqs: [], text: "" };
  for await (const ev of rs) {
    out.response_stream.types.push(ev.type);
    out.response_stream.seqs.push(ev.sequence_number);
    if (ev.type === "response.output_text.delta") out.response_stream.text += ev.delta;
    if (ev.type === "response.output_text.done") out.response_stream.done_text = ev.text;
    if (ev.response && ev.response.usage) out.response_stream.usage = ev.response.usage;
    if (ev.response) out.response_stream.status = ev.response.status;
  }

  // files: upload, list (auto-paginated by `after`), retrieve, delete; then delete every
  // file while paging through them one at a time (each next page's cursor is a file just
  // deleted)
  const line = JSON.stringify({
    custom_id: "a", method: "POST", url: "/v1/completions",
    body: { model, prompt: "Hi", max_tokens: 2 },
  });
  out.files_uploaded = [];
  for (let i = 0; i < 3; i++) {
    const f = await client.files.create({
      file: await OpenAI.toFile(Buffer.from(line + "\n"), `in${i}.jsonl`), purpose: "batch",
    });
    out.files_uploaded.push(f.id);
  }
  out.files_listed = [];
  for await (const f of client.files.list({ limit: 2 })) out.files_listed.push(f.id);
  out.files_batch = (await client.files.list({ purpose: "batch", order: "asc" })).data.map(
    (f) => f.id);
  out.file_deleted = await client.files.del(out.files_uploaded[1]);
  try {
    await client.files.retrieve(out.files_uploaded[1]);
    out.file_gone = null;
  } catch (e) {
    out.file_gone = { status: e.status, param: e.param, code: e.code };
  }
  out.files_deleted_paging = [];
  for await (const f of client.files.list({ limit: 1 })) {
    await client.files.del(f.id);
    out.files_deleted_paging.push(f.id);
  }
  out.files_left = (await client.files.list()).data.length;

  // a refusal is an SDK error with the gateway's status and message
  try {
    await client.responses.create({ model, input: "x", previous_response_id: "resp_1" });
    out.refusal = null;
  } catch (e) {
    out.refusal = { status: e.status, param: e.param, code: e.code };
  }
}

main().then(
  () => console.log(JSON.stringify(out)),
  (e) => {
    console.error("SDK call failed:", e);
    process.exit(1);
  },
);
