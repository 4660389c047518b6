// An agent that is not Python: the boundary is HTTP. turnrl runs it once per episode with
// OPENAI_BASE_URL, OPENAI_API_KEY and TURNRL_TASK (the task row as JSON) in its environment.
// It asks the model with the calculator tool, runs the calls itself, and prints its reward
// (1 for the right product, else 0) as its last line. Node 18+ (fetch), no packages.
//   dvc exp run -S env.name=agent -S '++env.options.command=node examples/agents/node_agent.mjs'
const task = JSON.parse(process.env.TURNRL_TASK);
const tools = [{type: "function", function: {name: "calculator", description: "Evaluate + - * / arithmetic.",
  parameters: {type: "object", properties: {expression: {type: "string"}}, required: ["expression"]}}}];

async function chat(messages) {
  const response = await fetch(`${process.env.OPENAI_BASE_URL}/chat/completions`, {
    method: "POST",
    headers: {"Content-Type": "application/json", Authorization: `Bearer ${process.env.OPENAI_API_KEY}`},
    body: JSON.stringify({model: "policy", messages, tools}),
  });
  if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
  return (await response.json()).choices[0].message;
}

function calculator(expression) {
  if (!/^[0-9+\-*/(). ]{1,100}$/.test(expression)) return "Error: only numbers, + - * / and parentheses";
  return String(Function(`"use strict"; return (${expression});`)());
}

const messages = [
  {role: "system", content: "Solve the problem. You can call the tools; their results come back as tool messages. " +
                            "Give the final answer as <answer>...</answer>."},
  {role: "user", content: task.prompt},
];
let reward = 0;
for (let turn = 0; turn < 3; turn++) {
  const message = await chat(messages);
  messages.push(message);
  if (!message.tool_calls || message.tool_calls.length === 0) {
    const found = [...(message.content || "").matchAll(/<answer>\s*(.*?)\s*<\/answer>/gs)].pop();
    reward = found && found[1] === String(task.answer) ? 1 : 0;
    break;
  }
  for (const call of message.tool_calls) {
    let result;
    try { result = calculator(JSON.parse(call.function.arguments).expression ?? ""); }
    catch (error) { result = `Error: ${error.message}`; }
    messages.push({role: "tool", tool_call_id: call.id, content: result});
  }
}
console.log(reward);
