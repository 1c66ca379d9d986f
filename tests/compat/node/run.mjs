// Runs one job with the real @azure/service-bus sender, for tests/compat/test_node_sdk.py.
//
//   node run.mjs '<job json>'      (or the job on stdin)
//
// A job: {"connectionString": "...", "entity": "orders", "steps": [step, ...]}, where a step is
//   {"op": "send", "messages": [msg, ...]}           one sendMessages call with the list
//   {"op": "sendEach", "messages": [msg, ...]}       one sendMessages call per message
//   {"op": "batch", "messages": [msg, ...]}          createMessageBatch + tryAddMessage each
//   {"op": "concurrent", "messages": [msg, ...]}     every send at once, on the one sender
//   {"op": "schedule", "messages": [...], "at": ISO, "cancel": [index, ...]}
//                                                    scheduleMessages, then cancel some
// and a msg is {"body": ..., "messageId": ..., "applicationProperties": {...}}.
// It prints one JSON line: {"ok": true, "steps": [result, ...]} or {"ok": false, "error": {...}}.
import { ServiceBusClient } from "@azure/service-bus";

async function readJob() {
  if (process.argv[2]) return JSON.parse(process.argv[2]);
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  return JSON.parse(Buffer.concat(chunks).toString("utf8"));
}

async function step(sender, s) {
  const messages = s.messages ?? [];
  switch (s.op) {
    case "send":
      await sender.sendMessages(messages);
      return { sent: messages.length };
    case "sendEach":
      for (const m of messages) await sender.sendMessages(m);
      return { sent: messages.length };
    case "batch": {
      const batch = await sender.createMessageBatch();
      for (const m of messages) {
        if (!batch.tryAddMessage(m)) throw new Error(`message ${m.messageId} does not fit`);
      }
      await sender.sendMessages(batch);
      return { sent: batch.count };
    }
    case "concurrent":
      await Promise.all(messages.map((m) => sender.sendMessages(m)));
      return { sent: messages.length };
    case "schedule": {
      const seqs = await sender.scheduleMessages(messages, new Date(s.at));
      const cancel = (s.cancel ?? []).map((i) => seqs[i]);
      if (cancel.length) await sender.cancelScheduledMessages(cancel);
      return { sequenceNumbers: seqs.map(String), cancelled: cancel.map(String) };
    }
    default:
      throw new Error(`unknown op ${s.op}`);
  }
}

const job = await readJob();
const client = new ServiceBusClient(job.connectionString, {
  retryOptions: { maxRetries: 0, timeoutInMs: job.timeoutMs ?? 15000 },
});
let out;
try {
  const sender = client.createSender(job.entity);
  const results = [];
  for (const s of job.steps) results.push(await step(sender, s));
  await sender.close();
  out = { ok: true, steps: results };
} catch (err) {
  out = { ok: false, error: { name: err?.name, code: err?.code, message: String(err?.message ?? err) } };
} finally {
  await client.close();
}
process.stdout.write(JSON.stringify(out) + "\n");
process.exitCode = out.ok ? 0 : 1;
