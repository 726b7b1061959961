package dev.sidecar.spring;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.EmbedRequest;
import dev.sidecar.v1.EmbedResponse;
import java.util.ArrayList;
import java.util.List;
import org.springframework.ai.chat.metadata.DefaultUsage;
import org.springframework.ai.document.Document;
import org.springframework.ai.embedding.Embedding;
import org.springframework.ai.embedding.EmbeddingModel;
import org.springframework.ai.embedding.EmbeddingRequest;
import org.springframework.ai.embedding.EmbeddingResponse;
import org.springframework.ai.embedding.EmbeddingResponseMetadata;

/** Spring AI {@link EmbeddingModel} over the sidecar's Embed RPC (unit-length vectors). */
public class SidecarEmbeddingModel implements EmbeddingModel {

    /** The Embed RPC's per-call input limit; larger requests are sent in batches. */
    static final int MAX_INPUTS = 256;

    private final SidecarClient client;
    private volatile Integer dimensions;

    public SidecarEmbeddingModel(SidecarClient client) {
        this.client = client;
    }

    @Override
    public EmbeddingResponse call(EmbeddingRequest request) {
        List<String> inputs = request.getInstructions();
        if (inputs.isEmpty()) {
            throw new IllegalArgumentException("inputs: at least one text is required");
        }
        String model = request.getOptions() != null && request.getOptions().getModel() != null
                ? request.getOptions().getModel() : "";
        List<Embedding> embeddings = new ArrayList<>(inputs.size());
        int promptTokens = 0;
        String servedModel = model;
        for (int start = 0; start < inputs.size(); start += MAX_INPUTS) {
            List<String> batch = inputs.subList(start, Math.min(inputs.size(), start + MAX_INPUTS));
            EmbedResponse r = client.embed(EmbedRequest.newBuilder().addAllInputs(batch).setModel(model).build());
            for (int i = 0; i < r.getEmbeddingsCount(); i++) {
                List<Float> values = r.getEmbeddings(i).getValuesList();
                float[] v = new float[values.size()];
                for (int j = 0; j < v.length; j++) {
                    v[j] = values.get(j);
                }
                embeddings.add(new Embedding(v, start + i));
            }
            promptTokens += r.getPromptTokens();
            servedModel = r.getModel();
        }
        return new EmbeddingResponse(embeddings,
                new EmbeddingResponseMetadata(servedModel, new DefaultUsage(promptTokens, 0, promptTokens)));
    }

    @Override
    public float[] embed(Document document) {
        return embed(getEmbeddingContent(document));
    }

    /** From the sidecar's model info when it reports it, else by embedding a probe text. */
    @Override
    public int dimensions() {
        Integer d = dimensions;
        if (d == null) {
            int reported = client.modelInfo().getEmbeddingDimensions();
            d = reported > 0 ? reported : EmbeddingModel.super.dimensions();
            dimensions = d;
        }
        return d;
    }
}
